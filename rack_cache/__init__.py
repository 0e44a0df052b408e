"""The rack cache (L2): a data-plane server in front of the PS nodes for the readers of one rack
(cache.py: the cache; server.py: request handling and links to the PS nodes; daemon.py: the daemon)."""
