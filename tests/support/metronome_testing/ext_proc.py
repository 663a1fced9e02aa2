"""Asks an endpoint picker where a request goes, the way a gateway does: Envoy's ext_proc gRPC stream
(envoy.service.ext_proc.v3.ExternalProcessor/Process, Python stubs from the xds-protos package).

Envoy sends the request's headers, then its body (the picker's gateways buffer it whole); the picker answers the
headers with a header mutation that sets `x-gateway-destination-endpoint` to the chosen pod's address:port (and
the same under the `envoy.lb` dynamic metadata), then answers the body. Nothing is forwarded anywhere: this only
reads the picker's choice.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA = "envoy.lb"


@dataclass(frozen=True)
class Pick:
    endpoint: str  # host:port from the header mutation
    metadata_endpoint: str  # the same, from envoy.lb dynamic metadata


class PickError(RuntimeError):
    """The picker answered with an immediate response (an error status) or without a destination."""


def _requests(body: dict, path: str, host: str):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

    raw = json.dumps(body).encode()
    headers = [(":method", "POST"), (":path", path), (":authority", host), (":scheme", "http"),
               ("content-type", "application/json"), ("content-length", str(len(raw))),
               ("x-request-id", str(uuid.uuid4()))]
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])
    yield ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=header_map, end_of_stream=False))
    yield ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=raw, end_of_stream=True))


def pick(target: str, body: dict, path: str = "/v1/completions", host: str = "gateway.local",
         timeout_s: float = 10.0) -> Pick:
    """One request's destination, from the picker listening at `target` (host:port, plaintext gRPC)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

    with grpc.insecure_channel(target) as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        responses = stub.Process(_requests(body, path, host), timeout=timeout_s)
        try:
            first = next(responses)
        finally:
            responses.cancel()
    if first.HasField("immediate_response"):
        reply = first.immediate_response
        raise PickError(f"the picker refused the request: HTTP {reply.status.code} {reply.body!r}")
    if not first.HasField("request_headers"):
        raise PickError(f"expected the request headers' answer first, got {first.WhichOneof('response')}")
    mutation = first.request_headers.response.header_mutation
    endpoint = next((h.header.raw_value.decode() or h.header.value for h in mutation.set_headers
                     if h.header.key.lower() == DESTINATION_HEADER), "")
    lb = first.dynamic_metadata.fields.get(DESTINATION_METADATA)
    metadata_endpoint = lb.struct_value.fields[DESTINATION_HEADER].string_value if lb is not None else ""
    if not endpoint:
        raise PickError(f"no {DESTINATION_HEADER} in the picker's answer: {first}")
    return Pick(endpoint, metadata_endpoint)
