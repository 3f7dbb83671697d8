"""Fault tests stop and restart the shared local services, so they are marked
`faults` and run last (both by the collection hook in tests/conftest.py), and
each leaves the services running. `make test-quick` leaves them out."""
