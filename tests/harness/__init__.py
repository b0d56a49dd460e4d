"""Shared in-process test stacks."""
