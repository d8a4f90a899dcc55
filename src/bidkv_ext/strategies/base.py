"""What a victim strategy is, and the registry that names them.

A strategy ranks the candidates it is given and returns one of them, or ``None`` to
abstain. It never mutates anything it receives. The selector hands it the candidates the
guards allow (usually the context's own tuple, so no copy is made).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from bidkv_ext.contract import PreemptionCandidate, PreemptionContext, PreemptionContextFacts

__all__ = ["BaselineRegistry", "Candidates", "StrategyRegistry", "VictimStrategy"]

Candidates = tuple[PreemptionCandidate, ...]


@runtime_checkable
class VictimStrategy(Protocol):
    """A named victim rule."""

    @property
    def name(self) -> str: ...

    def choose(
        self,
        candidates: Candidates,
        context: PreemptionContext,
        facts: PreemptionContextFacts | None,
    ) -> PreemptionCandidate | None: ...


class StrategyRegistry:
    """Strategies by name. Registering a taken name is an error, never a silent replace."""

    __slots__ = ("_strategies",)

    def __init__(self) -> None:
        self._strategies: dict[str, VictimStrategy] = {}

    def register(self, strategy: VictimStrategy) -> None:
        name = strategy.name
        if name in self._strategies:
            raise ValueError(f"strategy {name!r} is already registered")
        self._strategies[name] = strategy

    def get(self, name: str) -> VictimStrategy:
        try:
            return self._strategies[name]
        except KeyError:
            known = ", ".join(self.names())
            raise KeyError(f"unknown strategy {name!r}; registered: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._strategies)

    # The reference BidKV package's spelling of names(); kept so its examples run.
    def list_strategies(self) -> list[str]:
        return self.names()

    @property
    def count(self) -> int:
        return len(self._strategies)

    def __contains__(self, name: object) -> bool:
        return name in self._strategies

    def create_default_registry(self, config: object | None = None) -> None:
        """Add every built-in strategy whose name is not taken yet (mutates self)."""
        from bidkv_ext.strategies.catalog import builtin_strategies

        for strategy in builtin_strategies(config):
            if strategy.name not in self._strategies:
                self._strategies[strategy.name] = strategy


# The reference package's class name.
BaselineRegistry = StrategyRegistry
