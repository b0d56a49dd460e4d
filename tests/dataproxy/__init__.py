"""Tests of the dataproxy service."""
