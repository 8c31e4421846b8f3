"""The conductor: the global scheduler."""
