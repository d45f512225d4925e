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
RUN pip install . && useradd --create-home --uid 1000 gpulane

USER gpulane
EXPOSE 8000
CMD ["gpulane", "api", "--host", "0.0.0.0", "--port", "8000"]
