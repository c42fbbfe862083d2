# syntax=docker/dockerfile:1
# fenceproxy and the demo's billing program in one image (docker-compose.yml uses it for
# every service it builds).
#
#   docker build -t fenceproxy .
#   docker run --rm fenceproxy fenceproxy serve --help

ARG GO_VERSION=1.26
ARG DEBIAN=bookworm

FROM golang:${GO_VERSION}-${DEBIAN} AS build
WORKDIR /src
# An image older than the go directive in go.mod fetches the toolchain go.mod asks for.
ENV GOTOOLCHAIN=auto
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# cgo stays on: pg_query_go compiles PostgreSQL's own parser, in C, into fenceproxy.
RUN CGO_ENABLED=1 go build -trimpath -ldflags="-s -w" -o /out/fenceproxy ./cmd/fenceproxy \
 && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/billing ./cmd/billing

# The same Debian release as the build stage: fenceproxy links against its C library.
FROM debian:${DEBIAN}-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/fenceproxy /out/billing /usr/local/bin/
USER nobody
EXPOSE 6432
CMD ["fenceproxy", "--help"]
