"""The Engine's data-parallel-attention ranks (--enable-dp-attention): one engine per rank, each a
scheduler over its rank's KV, all stepping through one runner (runner_link.dp_step, dp_rounds.py).

Requests are spread over them as the router spreads them over replicas: its cache_aware policy
(services/router/policies/cache_aware.py), keyed by the prompt's token ids, so that a request
goes where its prefix was sent before unless the ranks' loads are too uneven; a rank's load is
its open requests.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from services.common.outputs import FinishReason, RequestOutput
from services.router.config import RouterConfig
from services.router.policies import Candidate, make_policy

if TYPE_CHECKING:
    from services.engine.engine import Engine


def prefix_key(ids: list[int]) -> str:
    """Token ids as a string the policy's prefix tree matches: one character per token."""
    return "".join(map(chr, ids))


class DpLanes:
    def __init__(self, first: Engine, others: list[Engine]) -> None:
        self.first, self.others = first, others
        self.lanes = [first, *others]  # index = data-parallel rank
        self.policy = make_policy("cache_aware", RouterConfig())
        self._open: dict[str, int] = {}  # rid → its rank, until every sequence of it ended
        self.picked: list[int] = []  # every request's rank, in submission order
        self._lock = threading.Lock()

    def pick(self, rid: str, ids: list[int], sink: Callable[[RequestOutput], None], n: int = 1
             ) -> tuple[Engine, Callable[[RequestOutput], None]]:
        """The engine that takes request `rid`, and the sink to give it (counts the request open
        until its `n` sequences end)."""
        key = prefix_key(ids)
        with self._lock:
            loads = [0] * len(self.lanes)
            for rank in self._open.values():
                loads[rank] += 1
            choice = self.policy.choose(key, [Candidate(f"dp{r}", load) for r, load in enumerate(loads)])
            self.policy.routed(key, choice.address)
            rank = int(choice.address.removeprefix("dp"))
            self._open[rid] = rank
            self.picked.append(rank)
        remaining = [n]

        def counted(out: RequestOutput) -> None:
            if out.finished:
                remaining[0] = 0 if out.finish_reason is FinishReason.ERROR else remaining[0] - 1
                if remaining[0] <= 0:
                    with self._lock:
                        self._open.pop(rid, None)
            sink(out)

        return self.lanes[rank], counted

    def lane_of(self, rid: str) -> Engine:
        """The engine holding request `rid` (the first one's when it is not open)."""
        with self._lock:
            return self.lanes[self._open.get(rid, 0)]
