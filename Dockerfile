# ftcore on NVIDIA's PyTorch image: the image's torch, Transformer Engine, NCCL and CUDA stay as
# they are; pip adds megatron-core, transformers, peft, hydra, ... and ftcore around them.
#   docker build -t ftcore .            (or: enroot import dockerd://ftcore / apptainer build)
# Newer bases work the same way (torch >= 2.6, Transformer Engine >= 2.0 inside).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.06-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /opt/ftcore
COPY pyproject.toml README.md ./
COPY ftcore ./ftcore
COPY conf ./conf
COPY launch ./launch
COPY slurm ./slurm

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# 1. Pin what the image built together (torch, triton, Transformer Engine, flash-attn, apex, numpy,
#    the CUDA wheels) to the installed versions: no dependency can pull a replacement from PyPI,
#    pip fails loudly instead.
# 2. Install ftcore without dependencies, then its dependencies minus torch and Transformer Engine
#    (the image's builds are the `gpu` extra here; TE from PyPI would be a second, mismatched copy).
# 3. Check that torch and Transformer Engine are the very same versions afterwards.
RUN pip list --format=freeze \
      | grep -i -E '^(torch[a-z]*|triton|transformer[-_]engine[-_a-z]*|flash[-_]attn[a-z0-9_-]*|apex|numpy|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' \
      > /tmp/image-constraints.txt \
 && grep -i -E '^(torch|transformer[-_]engine[-_a-z]*)==' /tmp/image-constraints.txt > /tmp/kept.txt \
 && pip install --no-cache-dir --no-deps . \
 && python -c "import importlib.metadata as m, re; print('\n'.join(r.split(';')[0] for r in m.requires('ftcore') if 'extra ==' not in r and not re.match(r'(torch|transformer.engine)\b', r, re.I)))" \
      > /tmp/ftcore-deps.txt \
 && pip install --no-cache-dir -c /tmp/image-constraints.txt -r /tmp/ftcore-deps.txt \
 && pip list --format=freeze | grep -i -E '^(torch|transformer[-_]engine[-_a-z]*)==' | diff /tmp/kept.txt - \
 && python -c "import ftcore.launch.node, ftcore.config, megatron.core; print('ftcore ready')"

WORKDIR /workspace
CMD ["python", "-m", "ftcore.train", "--help"]
