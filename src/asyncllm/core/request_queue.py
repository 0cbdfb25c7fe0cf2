"""Waiting queues: first come first served, or by priority (lower first, then arrival)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from asyncllm.config import SchedulingPolicy
from asyncllm.core.request import Request


class RequestQueue(ABC):
    """The scheduler's waiting requests. peek and pop raise IndexError when empty."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queues a new request in its place under the policy."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Queues a preempted request (FCFS: first of all; priority: in its place by
        priority and arrival), so it resumes before any request it was admitted ahead of."""

    @abstractmethod
    def peek(self) -> Request:
        """The request pop would return, left in the queue."""

    @abstractmethod
    def pop(self) -> Request:
        """Removes and returns the next request to admit."""

    @abstractmethod
    def remove_many(self, requests: Iterable[Request]) -> None:
        """Removes these requests (compared by identity); ones not queued are ignored.
        One pass over the queue, however many are removed (aborts come in batches)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In the order they would be popped."""


class FCFSQueue(RequestQueue):
    """Arrival order (order of `add`); `prepend` puts a request at the very front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove_many(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._q = deque(r for r in self._q if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(RequestQueue):
    """A heap on (priority, arrival time); a preempted request keeps its place by those,
    which puts it before every later arrival of its priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()  # equal keys: insertion order, never Request

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request)
        )

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_many(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._heap = [e for e in self._heap if id(e[3]) not in gone]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """The waiting queue for the scheduling policy."""
    return FCFSQueue() if policy is SchedulingPolicy.FCFS else PriorityQueue()
