"""Role switches of the elastic cells (:class:`Roles`): a rollout cell drains and switches to
training, pulls the weights (satellites), joins the trainer's stream, and returns to rollout
(at once when asked while still draining); and the publication of a new version to every
rollout engine (a weight-sync stall each)."""

from __future__ import annotations

from collections.abc import Callable

from sim.engine import Cell, Role
from sim.training import Training


class Roles(Training):
    """Moves between rollout and training, and weight publication."""

    def _set_role(self, c: Cell, role: Role) -> None:
        c.role = role
        self.role_epoch += 1
        self.placement.role_changed(c)

    def _after(self, c: Cell, mode: str, seconds: float, then: Callable[[Cell, int], None]) -> None:
        """``c`` spends ``seconds`` in ``mode``, then ``then`` runs (a no-op if anything
        newer happened to ``c`` meanwhile: its generation moved on)."""
        c.set_mode(self.loop.now, mode)
        c.gen += 1
        self.loop.schedule(self.loop.now + seconds, then, c, c.gen)

    def _switch(self, c: Cell, seconds: float, then: Callable[[Cell, int], None]) -> None:
        """A role switch of ``seconds`` (counted), then ``then``."""
        self.role_switches += 1
        self.switch_s += seconds
        self._after(c, "role_switch", seconds, then)

    def move_to_training(self, c: Cell) -> bool:
        if c.role is not Role.ROLLOUT:
            return False
        self._set_role(c, Role.DRAINING)  # first: no destination may be the source
        self._drain(c)
        self._switch(c, self.cc.switch_to_train_s, self._switched_to_training)
        self.fill()
        return True

    def _switched_to_training(self, c: Cell, gen: int) -> None:
        if gen != c.gen:
            return
        self._set_role(c, Role.TRAINING)
        if c.return_after_switch:
            c.return_after_switch = False
            self.return_to_rollout(c)
            return
        if c.index > 0 and self.cc.weight_sync_s > 0:  # satellites pull the core's weights
            self._after(c, "weight_sync", self.cc.weight_sync_s, self._join)
        else:
            self._join(c, c.gen)
        self.on_boundary()

    def _join(self, c: Cell, gen: int) -> None:
        if gen != c.gen or c.role is not Role.TRAINING:
            return
        self.trainer_progress()
        c.joined = True
        self.trainer.members.append(c)
        c.set_mode(self.loop.now, "idle_train")
        self._trainer_kick()

    def return_to_rollout(self, c: Cell) -> bool:
        if c.role is Role.DRAINING:
            changed = not c.return_after_switch
            c.return_after_switch = True
            return changed
        if c.role is not Role.TRAINING:
            return False
        self.trainer_progress()
        if c.joined:
            self.trainer.members.remove(c)
            c.joined = False
        self._set_role(c, Role.RETURNING)
        self._switch(c, self.cc.switch_to_rollout_s, self._switched_to_rollout)
        self._trainer_kick()
        return True

    def _switched_to_rollout(self, c: Cell, gen: int) -> None:
        if gen != c.gen:
            return
        self._set_role(c, Role.ROLLOUT)
        c.engine.version = self.published
        c.set_mode(self.loop.now, "rollout")
        self.fill()
        self.on_boundary()

    def publish(self, version: int) -> bool:
        """Loads ``version`` on every rollout engine (a stall of weight_sync_s each)."""
        if version <= self.published:
            return False
        t = self.loop.now
        self.published = version
        self.publishes += 1
        for c in self.cells:
            if c.role is Role.ROLLOUT:
                c.account(t)
                c.engine.add_stall("weight_sync", self.cc.weight_sync_s)
                c.engine.version = version
                self._reschedule(c)
        return True
