"""Engines drive methods: the in-process simulator (and, later, a Flower adapter)."""
