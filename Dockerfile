# syntax=docker/dockerfile:1
# distvideo on a CUDA image that already has torch. The image's torch is kept: distvideo is installed from its wheel
# with torch pinned to the version the image has, so pip fails instead of replacing it. One image for the three
# manifests in deploy/kubernetes/ (serve, torchrun, KubeRay): distvideo[ray] and ray[default] (the dashboard that
# KubeRay's probes and `ray job submit` use) at the Ray version the RayCluster names.
#
#   docker build -t my-registry/distvideo:0.1.0 .
#   docker build --build-arg BASE_IMAGE=my-registry/cuda-torch:latest -t my-registry/distvideo:0.1.0 .   # your own
#   docker run --gpus all --shm-size 8g -p 8000:8000 my-registry/distvideo:0.1.0   # the demo model, /health
#
# Any base image with CUDA, Python 3.10+, pip and torch 2.6 or newer works (a pre-release such as 2.6.0a0 counts as
# older than 2.6, and the install then fails rather than replace it); the default is PyTorch's official runtime image.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

# The wheel, built from the source tree (what `make dist` builds; .dockerignore sends only what the wheel needs).
FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${BASE_IMAGE}
# Keep equal to constraints-test.txt's ray pin and deploy/kubernetes/raycluster.yaml's rayVersion (a test checks).
ARG RAY_VERSION=2.60.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=wheel /dist /tmp/dist
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/keep-torch.txt \
    && wheels=(/tmp/dist/distvideo-*.whl) \
    && python -m pip install --no-cache-dir --constraint /tmp/keep-torch.txt \
        "${wheels[0]}[ray]" "ray[default]==${RAY_VERSION}" \
    && rm -rf /tmp/dist /tmp/keep-torch.txt \
    && distvideo plan --num-gpus 1 --json > /dev/null

# Not root. The Kubernetes manifests give the pods fsGroup 10001 so this user can write the mounted volumes.
RUN useradd --no-log-init --create-home --uid 10001 distvideo
USER 10001
WORKDIR /home/distvideo
ENV PYTHONUNBUFFERED=1 \
    HF_HOME=/home/distvideo/.cache/huggingface

EXPOSE 8000
# distvideo as PID 1 in exec form, so SIGTERM reaches it directly: `distvideo serve` drains within --shutdown-grace.
ENTRYPOINT ["distvideo"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
