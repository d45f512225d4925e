# One image for the API and the workers. For CUDA work, build FROM an
# nvidia/cuda runtime image with Python 3.11+ instead and add your task packages.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY dispatcher ./dispatcher
COPY worker ./worker
COPY gpulane.py ./
# Offline builds: wheels in .wheelhouse/ (`pip wheel -w .wheelhouse .` on a host that
# reaches a package index) are installed with no index at all; without any, `pip install .`
# takes the dependencies from PyPI as usual. README.md is named only so that the COPY
# has a source when .wheelhouse/ does not exist.
COPY README.md .wheelhous[e] /tmp/wheels/
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /tmp/wheels gpulane; \
    else \
        pip install .; \
    fi \
    && rm -rf /tmp/wheels \
    && useradd --create-home --uid 1000 gpulane

USER gpulane
EXPOSE 8000
CMD ["gpulane", "api", "--host", "0.0.0.0", "--port", "8000"]
