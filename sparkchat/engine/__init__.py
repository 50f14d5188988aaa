"""sparkchat's decode engine: the one public API the CLI, the terminal app and the server use.

    from sparkchat.engine import Engine, SamplingParams, Switches
    engine = Engine.load("path/to/model", device="auto")
    for event in engine.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=64)):
        print(event.text, end="")

Heavy imports (torch) happen on first use so `sparkchat --help` stays instant.
"""

from sparkchat.engine.errors import ContextOverflowError, ModelError, SparkchatError, TemplateError
from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams, Switches, SwitchState

__all__ = [
    "ContextOverflowError", "Engine", "GenerationStats", "ModelError", "ResponseEvent", "SamplingParams",
    "SparkchatError", "SwitchState", "Switches", "TemplateError",
]


def __getattr__(name: str):
    if name == "Engine":
        from sparkchat.engine.session import Engine

        return Engine
    raise AttributeError(name)
