# etcd for the compose cluster's optional etcd profile, from Debian's packages: a replicated,
# consensus-backed store for psring's control plane (`--store etcd://etcd0:2379,etcd1:2379,etcd2:2379`).
#   docker build -f deploy/etcd.Dockerfile -t psring-etcd:latest .
ARG BASE=debian:bookworm-slim
FROM ${BASE}

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends etcd-server etcd-client \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/etcd

EXPOSE 2379 2380
ENTRYPOINT ["etcd"]
