"""The decode worker."""
