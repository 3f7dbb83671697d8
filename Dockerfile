# The gateway image; compose.yaml uses it for both `gateway run` and the
# one-shot `gateway schema apply`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Every dependency ships manylinux wheels for CPython 3.11 (cassandra-driver
# >= 3.30 included), so no compiler is needed in the image.
COPY pyproject.toml README.md gateway.example.toml ./
COPY gateway/ ./gateway/
COPY schema/ ./schema/
RUN pip install --no-cache-dir .

# Unprivileged system user; the gateway needs no writable files in the image.
RUN useradd --system --no-create-home --home-dir /app --shell /usr/sbin/nologin gateway
USER gateway

# No ENTRYPOINT: `docker run IMAGE gateway schema apply` etc. work as written.
CMD ["gateway", "run"]
