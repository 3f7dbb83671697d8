"""MQTT edge-to-cloud gateway into Apache Cassandra."""

__version__ = "0.1.0"
