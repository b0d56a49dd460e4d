"""What every rollgate service runs on: settings helpers, logs, gRPC server and channels, errors."""
