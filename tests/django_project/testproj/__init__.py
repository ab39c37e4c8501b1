"""A Django 6 project whose tasks run on skiplock (tests/integration/test_django.py)."""
