"""`--network_module networks.lora`, sd-scripts' name for its LoRA, is `networks.lora_generic` here (same network,
same files); the run says so in its log."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from networks import lora_generic
from networks.lora_generic import LoRAModule, LoRANetwork

__all__ = ["LoRAModule", "LoRANetwork", "create_network", "create_network_from_weights"]

logger = logging.getLogger(__name__)


def _noted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (of networks.lora_generic, same signature) with one log line that says which network this is."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        logger.info("--network_module networks.lora is networks.lora_generic, the MOSS-Image LoRA (sd-scripts' name)")
        return fn(*args, **kwargs)

    return wrapped


create_network = _noted(lora_generic.create_network)
create_network_from_weights = _noted(lora_generic.create_network_from_weights)
