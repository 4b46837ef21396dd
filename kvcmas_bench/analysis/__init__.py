"""Analyses over recorded caches (reconstruction coverage, ...)."""
