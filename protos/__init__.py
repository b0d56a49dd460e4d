"""Generated gRPC stubs and their .proto sources (regenerate with protos/generate.sh)."""
