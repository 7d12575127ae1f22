"""What a step's output processing decided, as plain data for the scheduler to carry out.

Output processing (appending sampled tokens, beam search, stop checks) runs inside
`Scheduler.update_from_output`, after the computed tokens are counted; it changes sequences
(their tokens and statuses) but never the KV cache manager: the forks and drops it returns are
applied by the scheduler, the only writer of the block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup


@dataclass
class StepUpdate:
    # The groups whose sequences changed (tokens, prompt log-probabilities, statuses), in
    # schedule order.
    touched: list[SequenceGroup] = field(default_factory=list)
    # (parent, child): the child, a new sequence copied from the parent before the parent took
    # this step's token, starts with the parent's blocks (a parallel sample, a surviving beam).
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    # Sequences with no future (beams that lost): their blocks are freed at once.
    dropped: list[Sequence] = field(default_factory=list)
    # Set by the scheduler as it applies the update: the groups that finished in this step.
    finished: list[SequenceGroup] = field(default_factory=list)


# Output processing: (the step's control message, what the model returned, the update to fill).
ProcessOutput = Callable[[SchedulerOutput, ModelRunnerOutput, StepUpdate], None]
