"""The OpenTelemetry resource of every span a mode emits.

Who this process is (service, rank, host, process) and which run it belongs
to, merged from what the SDK and commspan detect, the environment, the user's
``tracer_provider`` and ``resource_attributes=``; see :func:`build_resource`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider

from commspan import semconv
from commspan.capture.ranks import Ranks

__all__ = ["build_resource"]

_log = logging.getLogger(__name__)


def build_resource(
    ranks: Ranks,
    run_id: str,
    tracer_provider: TracerProvider | None,
    extra: Mapping[str, Any],
) -> Resource:
    """The resource of every span. Lowest precedence first:

    1. what the SDK detects (``telemetry.sdk.*``, its random
       ``service.instance.id``, the detectors ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``
       names);
    2. what commspan detects: ``service.name`` ``commspan``,
       ``service.instance.id`` (the rank), ``host.name``, ``process.pid``;
    3. ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``;
    4. the tracer_provider's resource, less what the SDK put there by itself
       (the placeholder ``service.name`` ``unknown_service…``, its
       ``service.instance.id``);
    5. ``extra`` (the mode's ``resource_attributes=``; ``None`` leaves a key out).

    commspan's own ids (rank, local rank, world size, run id) are set after
    3 and 4, so neither the environment nor a provider can change them.

    Args:
        ranks: this process's rank, local rank and world size.
        run_id: the run id every rank agreed on.
        tracer_provider: the user's provider, if any.
        extra: ``resource_attributes=``, already checked.
    """
    sdk = Resource.create()
    automatic = dict(sdk.attributes)
    attrs: dict[str, Any] = dict(automatic)
    attrs.update({
        semconv.SERVICE_NAME: "commspan",
        semconv.SERVICE_INSTANCE_ID: str(ranks.rank),
        semconv.HOST_NAME: socket.gethostname(),
        semconv.PROCESS_PID: os.getpid(),
    })
    attrs.update(OTELResourceDetector().detect().attributes)
    schema_url = sdk.schema_url
    if tracer_provider is not None:
        provided = tracer_provider.resource
        for key, value in provided.attributes.items():
            if key in automatic and automatic[key] == value:
                continue  # the SDK's own value, not a choice of the user's
            if key == semconv.SERVICE_NAME and str(value).startswith("unknown_service"):
                continue
            attrs[key] = value
        schema_url = schema_url or provided.schema_url
    own: dict[str, Any] = {
        semconv.RANK: ranks.rank,
        semconv.LOCAL_RANK: ranks.local_rank,
        semconv.WORLD_SIZE: ranks.world_size,
        semconv.RUN_ID: run_id,
    }
    ignored = sorted(k for k, v in own.items() if k in attrs and attrs[k] != v)
    if ignored:
        _log.warning(
            "commspan: resource attributes %s from OTEL_RESOURCE_ATTRIBUTES or the "
            "tracer_provider's resource are ignored; commspan sets them (run_id= sets "
            "the run id)", ", ".join(ignored),
        )
    attrs.update(own)
    if ranks.local_rank is None:  # unknown (no LOCAL_RANK in a world of several ranks)
        del attrs[semconv.LOCAL_RANK]
    for key, value in extra.items():
        if value is None:
            attrs.pop(key, None)
        else:
            attrs[key] = value
    return Resource(attrs, schema_url)
