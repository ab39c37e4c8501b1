#!/usr/bin/env python
"""manage.py of the tiny Django project skiplock's Django tests run."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
