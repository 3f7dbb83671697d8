"""The steps of bench/run.py that are not one system under test: setup, the
sustained drain and the latency runs every system goes through, the
gateway-only phases (scaling, overload, states) and the report."""
