"""rollgate: record every agent conversation as RL training data (client library and CLI)."""

__version__ = "0.1.0"
