"""rollgate services: each runs as its own process and meets the others only through protos."""
