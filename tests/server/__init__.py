"""The OpenAI-compatible server tests, split by concern; shared server fixtures live in conftest.py."""
