"""Integrations of skiplock with frameworks; each lives in a subpackage of its own."""
