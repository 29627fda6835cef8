"""End-to-end checks of what a decode node served, from its reply alone.

- Every page the request held before its first decode step is bit-identical to bytes that were
  computed for that page: a page sent by prefill equals what prefill says it sent; a page
  restored from any tier equals a version that a producer computed earlier (prefill for prompt
  pages, the decode step for output pages). A page can have more than one version only when the
  cache lost every copy and it was computed again, so "restoring copies, never alters" is
  exactly this check. A tensor-parallel node's reply carries each rank's pages (its own heads)
  beside rank 0's (`tp_ranks`): each rank's pages are checked against that rank's versions.
- The assembled KV matches one monolithic forward pass over the prompt within 1e-9 relative
  error (the model runs in float64), and the generated tokens equal greedy generation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hicache.core.pages import namespace_seed, page_keys
from hicache.runtime.model.llama import TinyModel

REL_TOL = 1e-9


class KVLedger:
    """The digests of every version of every page key seen so far, across requests (and across
    restarts of the decode node, when the caller keeps the ledger)."""

    def __init__(self, model: TinyModel, page_size: int, model_name: str = "tiny") -> None:
        self.model = model
        self.page = page_size
        self.model_name = model_name
        self.versions: dict[int, set[str]] = {}  # rank 0's (the only rank of a one-rank node)
        self.rank_versions: dict[int, dict[int, set[str]]] = {0: self.versions}

    def check(
        self,
        prompt: list[int],
        max_new: int,
        reply: dict[str, Any],
        kv: np.ndarray | None,
        *,
        tenant: str | None = None,
    ) -> list[str]:
        """Problems with one finished request (empty: correct); then records its pages."""
        problems: list[str] = []
        rid = reply.get("rid")
        if reply.get("outcome") != "finished":
            return [f"{rid}: {reply.get('outcome')}: {reply.get('reason')}"]
        for rank, part in enumerate(self._ranks(reply)):
            versions = self.rank_versions.setdefault(rank, {})
            on = f" on rank {rank}" if rank else ""
            for i, p in enumerate(part["start_pages"]):
                if p["digest"] is None:  # not read: the request did not ask for proof (`verify`)
                    continue
                if p["source"] == "prefill":
                    if p["digest"] != p["sent"]:
                        problems.append(f"{rid}: page {i}{on} differs from what prefill sent")
                elif p["key"] is None or p["digest"] not in versions.get(int(p["key"]), set()):
                    problems.append(
                        f"{rid}: restored page {i}{on} matches no version ever computed for its key"
                    )
        tokens = torch.tensor(prompt, dtype=torch.int64)
        want, _ = self.model.generate(tokens, max_new)
        if reply["tokens"] != want.tolist():
            problems.append(
                f"{rid}: generated {reply['tokens'][:8]}..., greedy generation gives {want.tolist()[:8]}..."
            )
        if kv is not None:
            mono = self.model.monolithic_kv(tokens).contiguous().numpy()
            got = kv.reshape(mono.shape)
            err = float(np.max(np.abs(got - mono)) / max(float(np.max(np.abs(mono))), 1e-300))
            if not err <= REL_TOL:
                problems.append(
                    f"{rid}: assembled KV differs from a monolithic forward by {err:.3g} (relative)"
                )
        self._record(prompt, reply, tenant)
        return problems

    @staticmethod
    def _ranks(reply: dict[str, Any]) -> list[dict[str, Any]]:
        """Each rank's page reports: rank 0's are the reply's own."""
        return [reply, *reply.get("tp_ranks", ())]

    def _record(self, prompt: list[int], reply: dict[str, Any], tenant: str | None) -> None:
        seq = prompt + reply["tokens"][:-1]  # the last token's KV is never computed
        seed = namespace_seed(self.model_name, tenant)
        keys = page_keys(np.asarray(seq, dtype=np.int64), self.page, seed).tolist()
        for rank, part in enumerate(self._ranks(reply)):
            versions = self.rank_versions.setdefault(rank, {})
            for p in part["start_pages"]:
                if p["source"] == "prefill" and p["key"] is not None:
                    versions.setdefault(int(p["key"]), set()).add(p["sent"])
            for key, digest in zip(keys, part["final_pages"], strict=False):
                if digest is not None:
                    versions.setdefault(key, set()).add(digest)
