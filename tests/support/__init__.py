"""Test helpers: servers, processes, waiting on conditions, sample documents."""
