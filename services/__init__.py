"""The four halfmoon services and the `halfmoon` command line."""
