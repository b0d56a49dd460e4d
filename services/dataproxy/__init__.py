"""The dataproxy service."""
