"""What every process of the plugin imports: the typed messages and their codec, the RPC declarations, the
two-phase update, the server's options and the successor rule."""
