# syntax=docker/dockerfile:1
# fenceproxy and the demo's billing program in one image (docker-compose.yml uses it for
# every service it builds).
#
#   docker build --build-arg VERSION="$(git describe --tags --always --dirty)" -t fenceproxy .
#   docker run --rm fenceproxy fenceproxy serve --help
#
# VERSION is what `fenceproxy version` prints (.git is not sent to the build: .dockerignore).

ARG GO_VERSION=1.26
ARG DEBIAN=bookworm

FROM golang:${GO_VERSION}-${DEBIAN} AS build
WORKDIR /src
# An image older than the go directive in go.mod fetches the toolchain go.mod asks for.
ENV GOTOOLCHAIN=auto
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# Pure Go, static binaries (fenceproxy parses no SQL since fencing v2: no cgo).
ARG VERSION=unknown
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=${VERSION}" -o /out/fenceproxy ./cmd/fenceproxy \
 && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/billing ./cmd/billing

FROM debian:${DEBIAN}-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/fenceproxy /out/billing /usr/local/bin/
# The proxy key file's folder (fenceproxy migrate --key-file /var/lib/fenceproxy/fenceproxy.key
# creates the file, readable by its owner only): writable by the user the containers run as. A
# named volume mounted here starts as a copy of it, ownership included (docker-compose.yml).
RUN mkdir -p /var/lib/fenceproxy && chown nobody:nogroup /var/lib/fenceproxy && chmod 0700 /var/lib/fenceproxy
USER nobody
EXPOSE 7432
CMD ["fenceproxy", "--help"]
