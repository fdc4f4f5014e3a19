"""LoRA adapters served beside the base model, as vLLM serves them: `lmkit serve --lora NAME=DIR ...` at start-up,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter at run time ({"lora_name", "lora_path"}, vLLM's fields and
answers), each adapter a model of its own in /v1/models (its `parent` the base); a request whose `model` names one
decodes with it, in the same batch as the others (`generation.lora_rows`)."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from lmkit.errors import LmkitError
from lmkit.serve.http import read_json
from lmkit.serve.protocol import APIError, check_fields


def parse_loras(specs: list[str] | None) -> dict[str, str]:
    """{name: folder} of `--lora NAME=DIR` values; a LmkitError naming a malformed or repeated one."""
    from lmkit.errors import ConfigError

    out: dict[str, str] = {}
    for spec in specs or []:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--lora {spec}: give NAME=ADAPTER_DIR (the name requests give as their model)")
        if name in out:
            raise ConfigError(f"--lora {name} is given twice; give each adapter one name")
        out[name] = folder
    return out


def load_lora(server, name: str, folder: str | Path) -> None:
    """Read the PEFT-format LoRA in `folder` and serve it as model `name` (raises LmkitError when it cannot)."""
    from lmkit.errors import ConfigError
    from lmkit.peft import lora_weights

    if name == server.model_name or name in server.engine.adapters.names:
        raise ConfigError(f"the model name {name!r} is taken already; give the adapter another name")
    if not Path(folder).is_dir():
        raise ConfigError(f"{folder} is not a folder; give a LoRA adapter folder (adapter_config.json and "
                          "adapter_model.safetensors)")
    weights = lora_weights(server.engine.adapters.bare, folder)
    if getattr(server.engine, "remote", False):  # an engine process reads the adapter from its folder too
        server.engine.add_adapter(name, weights, folder=str(folder))
    else:
        server.engine.add_adapter(name, weights)
    server.loras[name] = str(folder)


def model_cards(server, card: dict) -> list[dict]:
    """/v1/models' entries: the base model's `card`, then one per adapter (as vLLM lists them)."""
    return [card] + [{**card, "id": name, "root": folder, "parent": server.model_name}
                     for name, folder in server.loras.items()]


def register(app: FastAPI, server, max_body: int) -> None:
    """The run-time loading routes."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = check_fields(await read_json(request, max_body), {"lora_name", "lora_path", "load_inplace"})
        server.check_ready()
        name, folder = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(folder, str) or not folder:
            raise APIError(400, "give lora_name and lora_path, both strings", param="lora_name")
        if server.engine is None:
            raise APIError(400, "this server holds an encoder; LoRA adapters decode with a decoder",
                           code="not_generative")
        try:
            await run_in_threadpool(load_lora, server, name, folder)
        except LmkitError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = check_fields(await read_json(request, max_body), {"lora_name", "lora_int_id"})
        server.check_ready()
        name = body.get("lora_name")
        if server.engine is None or name not in server.loras:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        try:
            server.engine.remove_adapter(name)
        except LmkitError as exc:
            raise APIError(400, str(exc), param="lora_name", code="adapter_in_use") from None
        del server.loras[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
