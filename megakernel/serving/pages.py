"""The host's allocator of KV cache pages, and the block table it keeps for the device.

The pool holds ``pages`` pages of ``page_size`` positions (``tasks.kv_cache``: paged caches); one
more, the spill page, is every unallocated entry of the block table, so that a row that runs past the
pages it was given (a sequence that ended inside a launch) writes only there, never into another
sequence's pages. Pages are taken as a row grows and given back when it is released; a launch's
growth is all or nothing (``transaction``): out of pages, nothing it took stays taken. Where another
scheduler owns the pages (vLLM), ``waves`` orders the requests of its step that share them.
"""
from __future__ import annotations

import graphlib
from contextlib import contextmanager
from typing import Iterator

import torch

from ..errors import GraphError


class KVCacheFull(GraphError):
    """The KV cache pool has no free page for a sequence: the message names the sequence and the pool.
    Nothing changed: cancel a sequence (``DecodeModel.cancel``) or build with more ``kv_pages``."""


class PagePool:
    def __init__(self, pages: int, page_size: int, rows: int, max_pages: int):
        self.pages, self.page_size = pages, page_size
        self.free = list(range(pages - 1, -1, -1))          # popped from the end: lowest page first
        self.held: list[list[int]] = [[] for _ in range(rows)]  # per block table row, its pages in order
        self.table = torch.full((rows, max_pages), pages, dtype=torch.int64)  # unallocated: the spill page
        self._taken: list[tuple[int, int]] | None = None    # (row, page) taken in the open transaction

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def grow(self, row: int, positions: int, who: str) -> None:
        """Give ``row`` pages for its first ``positions`` positions; ``who`` names it in the error."""
        need = self.pages_for(positions) - len(self.held[row])
        if need > len(self.free):
            raise KVCacheFull(f"KV cache full: {who} needs {need} more page(s) of {self.page_size} positions for "
                              f"{positions} positions; the pool has {self.pages} pages and {len(self.free)} free. "
                              f"Nothing changed: cancel a sequence, or build with more kv_pages")
        for _ in range(max(need, 0)):
            page = self.free.pop()
            self.table[row, len(self.held[row])] = page
            self.held[row].append(page)
            if self._taken is not None:
                self._taken.append((row, page))

    def release(self, row: int) -> None:
        """Give back every page of ``row``; its block table row points at the spill page again."""
        self.free.extend(reversed(self.held[row]))
        self.held[row] = []
        self.table[row] = self.pages

    def share(self, row: int, source: int) -> None:
        """Block table row ``row`` holds ``source``'s pages (a prefill row of the sequence in ``source``)."""
        self.table[row] = self.table[source]

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Every ``grow`` inside is undone if the block raises."""
        if self._taken is not None:
            raise GraphError("page pool: transactions do not nest")
        self._taken = []
        try:
            yield
        except BaseException:
            for row, page in reversed(self._taken):
                self.held[row].pop()
                self.table[row, len(self.held[row])] = self.pages
                self.free.append(page)
            raise
        finally:
            self._taken = None


def waves(requests: list[tuple[int, int, torch.Tensor]], page_size: int) -> list[list[int]]:
    """The requests of one step that another scheduler planned (``CompiledModel.run_scheduled``), each
    ``(first, last, pages)`` (it writes positions ``first ..= last`` and reads ``0 ..= last`` through its
    ``pages``), in waves: a request that reads a pool position another request of the step writes (a
    prefix cache handing out a page in the step that computes it) comes in a later wave than that writer.

    A step's graph orders a request's KV appends before the attention that reads them only within the
    request's own rows (its prefill rows, then its batch row), so two requests joined this way run as
    two steps, the writer's first. Two requests that write one position, or that read each other's, are
    refused (``GraphError``): no order makes such a plan what it means."""
    if _apart(requests, page_size):
        return [list(range(len(requests)))]

    def pool_rows(first: int, last: int, pages: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(first, last + 1)
        return pages[positions // page_size] * page_size + positions % page_size

    written = [pool_rows(first, last, pages) for first, last, pages in requests]
    rows, owners = torch.cat(written), torch.cat([torch.full_like(w, i) for i, w in enumerate(written)])
    unique, counts = rows.unique(return_counts=True)
    if bool((counts > 1).any()):
        row = int(unique[counts > 1][0])
        both = owners[rows == row].tolist()
        raise GraphError(f"run_scheduled: requests {both[0]} and {both[1]} both write position {row % page_size} of "
                         f"page {row // page_size}")
    sorter = graphlib.TopologicalSorter()
    for i, (first, last, pages) in enumerate(requests):
        read = torch.isin(rows, pool_rows(0, last, pages)) & (owners != i)
        sorter.add(i, *owners[read].unique().tolist())
    try:
        sorter.prepare()
    except graphlib.CycleError as error:
        raise GraphError(f"run_scheduled: requests {sorted(set(error.args[1]))} each read a position another of them "
                         f"writes in the step") from None
    order: list[list[int]] = []
    while sorter.is_active():
        order.append(sorted(sorter.get_ready()))
        sorter.done(*order[-1])
    return order


def _apart(requests: list[tuple[int, int, torch.Tensor]], page_size: int) -> bool:
    """Whether no request of ``waves``' reads or writes a page another one writes, and none writes a page
    twice (the common step: each request writes its own last pages), which makes one wave; checked by pages
    in plain Python, a few µs a request, where the positions' check costs ~100."""
    writer: dict[int, int] = {}
    reads = []
    for i, (first, last, pages) in enumerate(requests):
        listed = pages.tolist()
        for page in listed[first // page_size:last // page_size + 1]:
            if page in writer:
                return False
            writer[page] = i
        reads.append(listed[:last // page_size + 1])
    return all(writer.get(page, i) == i for i, read in enumerate(reads) for page in read)
