"""Fault tests stop and restart the shared local services, so they run last
(see tests/conftest.py) and each leaves the services running."""
