"""Prompt datasets and verifiable rewards."""
