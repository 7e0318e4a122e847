"""The composition root: builds every part from one Settings object and runs its lifecycle."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import filelock
import structlog

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import COMPLETION_CANCELLED, COMPLETION_ERROR, COMPLETION_RESULT, SYSTEM_HEALTH
from ksi_common.kept_settings import write_kept
from ksi_common.liveness import socket_path_state
from ksi_common.privacy import FILE_MODE, OWNER_ONLY_UMASK, private_dir
from ksi_common.settings import Settings
from ksi_daemon.context import EventContext
from ksi_daemon.providers.cli_provider import cli_providers
from ksi_daemon.providers.litellm_provider import LiteLLMProvider
from ksi_daemon.router import Router, Unregister
from ksi_daemon.services.agents.profiles import ProfileLibrary
from ksi_daemon.services.agents.registry import AgentRegistry
from ksi_daemon.services.agents.service import AgentService
from ksi_daemon.services.completion.admission import Admission
from ksi_daemon.services.completion.answerers import Answerers
from ksi_daemon.services.completion.attachments import Attachments
from ksi_daemon.services.completion.calibration import Calibration
from ksi_daemon.services.completion.compaction import Compactor
from ksi_daemon.services.completion.file_roots import FileRoots
from ksi_daemon.services.completion.images import Images
from ksi_daemon.services.completion.preparation import HistoryBudget, TurnPreparation
from ksi_daemon.services.completion.requests import RequestRegistry
from ksi_daemon.services.completion.running import TurnRunner
from ksi_daemon.services.completion.scheduler import Scheduler
from ksi_daemon.services.completion.service import CompletionService
from ksi_daemon.services.consortium.service import ConsortiumService
from ksi_daemon.services.conversations.memory import ConversationCache
from ksi_daemon.services.conversations.pending import WAITING_RELAYED
from ksi_daemon.services.conversations.service import ConversationService
from ksi_daemon.services.conversations.writer import ConversationWriter
from ksi_daemon.services.lifecycle import Starts, Stops
from ksi_daemon.services.limits import ConcurrencyLimits
from ksi_daemon.services.monitor import MonitorService
from ksi_daemon.services.pool.claiming import OfferClaims
from ksi_daemon.services.pool.elsewhere import RequestsElsewhere
from ksi_daemon.services.pool.members import PoolService
from ksi_daemon.services.pool.takeover import TakeoverService
from ksi_daemon.services.rates import RateLimitedProvider
from ksi_daemon.services.resilience import CircuitBreaker
from ksi_daemon.services.system import SystemService
from ksi_daemon.storage.backends import build_storage
from ksi_daemon.transports.budget import ConnectionBudget
from ksi_daemon.transports.http.binding import NoHttpFront
from ksi_daemon.transports.unix import SocketServer

if TYPE_CHECKING:
    from ksi_daemon.transports.http.front import HttpFront

log = structlog.get_logger("ksi.daemon")


RELAYED = frozenset({COMPLETION_RESULT, COMPLETION_ERROR, COMPLETION_CANCELLED})


class DaemonAlreadyRunning(RuntimeError):
    pass


class UnsafeVarDir(RuntimeError):
    pass


class UnsafeSocketPath(UnsafeVarDir):
    """Something that is not a stale KSI socket sits at the socket path: it is never removed."""


class Daemon:
    """Start, serve, shut down: the staged lifecycle of one daemon on one var dir."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.clock = clock  # wall time for TTLs and activity stamps; tests pass a fake one
        self.layout = settings.layout
        self.router = Router()
        self.stopping = asyncio.Event()
        self._unregister: list[Unregister] = []
        self._lock: filelock.BaseFileLock | None = None
        self._umask = OWNER_ONLY_UMASK
        self.shutting_down = False
        # one budget of descriptors for the connections of every door (the Unix socket, and HTTP when served)
        self.connection_budget = ConnectionBudget.for_process(settings.max_connections,
                                                              listeners=2 if settings.http_addr else 1)
        self.server = SocketServer(settings.socket, self._handle_request, line_limit=settings.line_limit,
                                   push_queue_size=settings.push_queue_size,
                                   max_inflight=settings.max_inflight_per_connection,
                                   allow_uids=settings.allow_uids, budget=self.connection_budget)
        self.storage = build_storage(settings)  # KSI_STORAGE picks the backend by name
        self.store = self.storage.conversations
        self.responses = self.storage.responses
        self.litellm = LiteLLMProvider(settings)
        self.cache = ConversationCache(self.store, self.responses, settings.active_conversations,
                                       count_tokens=self.litellm.count_tokens_loading,
                                       announce=self._announce_waiting)
        # the one write path of conversations, shared by every service that changes one
        self.writer = ConversationWriter(self.cache, self.storage.summaries, clock=clock,
                                         default_ttl=settings.default_ttl, max_fork_depth=settings.max_fork_depth)
        self.limits, self.provider, self.breaker = self._call_guards()
        # consortium members and arbiters are called through the same provider as any completion
        self.consortium = ConsortiumService(
            settings, self.router, self.storage.consortia, self.storage.traces, self.responses,
            provider=self.provider, limits=self.limits, breaker=self.breaker,
        )
        # the agents' registry is built before both services that use it: the completion service
        # reads agents' defaults from it, the agent service submits completions
        self.agent_registry = AgentRegistry(settings, self.storage.agents)
        self.completion, self.history_budget = self._completion_path(clock)
        self.conversations = ConversationService(
            settings, self.router, self.cache, self.writer, self.storage.blobs, clock=clock,
            cancel_requests=self.completion.end_conversation,
            calibration=self.completion.calibration.report,
            pins_budget=self.history_budget.pins,
        )
        self.agents = AgentService(
            settings, self.router, self.completion, self.cache, self.writer, self.agent_registry,
            ProfileLibrary(settings.profiles_dir),
        )
        self.monitor = MonitorService(self.router)
        self.pool, self.takeover, self.claiming = self._pool_services()
        self.system = self._system_service()
        self.http = self._http_front()
        # the pool last: registered once every other part is ready, removed first at a stop
        self._services: list[Any] = [self.system, self.monitor, self.completion, self.consortium, self.agents,
                                     self.conversations, self.pool, self.takeover, self.claiming]
        self._preload: asyncio.Task[Any] | None = None

    def _call_guards(self) -> tuple[ConcurrencyLimits, RateLimitedProvider, CircuitBreaker]:
        """What every provider call passes, plain completions and consortium members alike."""
        settings = self.settings
        limits = ConcurrencyLimits(settings.max_concurrency, lambda m: settings.model_settings(m).max_concurrency,
                                   pool=self.storage.slots, pool_limit=settings.pool_max_concurrency)
        # every call counts against its model's rates, over every daemon sharing the storage
        provider = RateLimitedProvider(self.litellm, self.storage.rates, settings, self.litellm.count_tokens_loading)
        # one circuit per model and endpoint, whoever calls it: a server that fails a completion's
        # calls is not asked again by a consortium member meanwhile, nor the other way round
        return limits, provider, CircuitBreaker(settings.circuit_failures, settings.circuit_reset)

    def _pool_services(self) -> tuple[PoolService, TakeoverService, OfferClaims]:
        """This daemon's membership of the pool, and the two ways it runs other daemons' turns."""
        scheduler = self.completion.scheduler
        pool = PoolService(self.settings, self.router, self.storage.daemons, self.storage.daemon_id,
                           load=lambda: (scheduler.running, scheduler.queued - scheduler.running,
                                         self.storage.leases.held()))
        # the requests of a daemon of the pool that died are run here (or found done)
        takeover = TakeoverService(self.settings, self.storage.requests, self.completion,
                                   shared=self.storage.daemons.shared, own_silence=pool.silent_for,
                                   steady_for=pool.steady_for)
        # turns other daemons at their limits offered are run here while this daemon has room
        claiming = OfferClaims(self.settings, self.storage.requests, self.completion,
                               shared=self.storage.daemons.shared, others_alive=pool.others_alive)
        return pool, takeover, claiming

    def _system_service(self) -> SystemService:
        """`system:*`: health drawn from every part, settings, shutdown."""
        return SystemService(
            self.router,
            request_shutdown=self.request_shutdown,
            health_sections={
                "connections": lambda: len(self.server.connections),
                "subscriptions": self.monitor.count,
                "completions": self.completion.health,
                "consortia": self.consortium.health,
                "agents": self.agents.count,
                "litellm_loaded": lambda: self.litellm.loaded,
                "http": lambda: self.http.url,
                "var_dir": lambda: str(self.settings.var_dir),
                "storage": self.storage.describe,
                "cluster": self.pool.health,
            },
            settings_view=self.settings.public_view,
            settings_origins=lambda: {"origins": self.settings.origins,
                                      "config_file": str(self.settings.config_file)},
        )

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        # everything the daemon or a library it uses creates is owner-only, whatever the umask
        # it was started with (restored at shutdown, for a daemon run inside another program)
        self._umask = os.umask(OWNER_ONLY_UMASK)
        try:
            await self._start()
        except BaseException:
            os.umask(self._umask)
            raise

    async def _start(self) -> None:
        self._prepare_dirs()
        self._acquire_lock()
        try:
            self._clear_stale_files()
            # what this start was given, for a restart from a shell that lacks it
            write_kept(self.layout.kept_settings_file, self.settings.given_at_start())
            await self.storage.open()
        except BaseException:
            self._release_lock()
            raise
        for service in self._services:
            self._unregister.extend(service.register())
        for service in self._services:
            if isinstance(service, Starts):
                await service.start()
        # completion outcomes reach the subscribers of every daemon sharing this storage
        await self.storage.relay.start(self._deliver_remote)
        self._unregister.append(self.router.listen("completion:*", self._relay_outcome))
        # the socket last: a client takes a daemon whose socket answers as started (`ksi daemon
        # start` prints the HTTP address from the first health reply), so every door is open by then
        await self.http.start()
        try:
            await self.server.start()
        except BaseException:
            await self.http.stop()
            raise
        self.layout.pid_file.write_text(f"{os.getpid()}\n")
        if self.settings.litellm_preload:
            # litellm's multi-second import happens after the socket answers, off the loop
            self._preload = asyncio.get_running_loop().create_task(self.litellm.ensure_loaded())
        log.info("daemon_started", socket=str(self.settings.socket), pid=os.getpid())

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_shutdown)
        try:
            await self.stopping.wait()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            await self.shutdown()

    def request_shutdown(self) -> None:
        self.shutting_down = True
        self.stopping.set()

    async def shutdown(self) -> None:
        """Stop accepting, drain in-flight work within the timeout, flush, remove socket and pid."""
        self.shutting_down = True
        self.server.stop_accepting()
        for service in reversed(self._services):
            if isinstance(service, Stops):
                try:
                    await service.stop(self.settings.shutdown_timeout)
                except Exception:
                    log.exception("service_stop_failed", service=type(service).__name__)
        if self._preload is not None:  # nothing needs litellm any more; its thread is left to the exit
            self._preload.cancel()
        await self.server.drain(self.settings.shutdown_timeout)
        await self.http.stop()
        await self.server.close()
        for unregister in self._unregister:
            unregister()
        self._unregister.clear()
        try:
            await self.storage.close()
        except Exception:
            log.exception("storage_close_failed")
        try:
            self.layout.pid_file.unlink()
        except FileNotFoundError:
            pass
        self._release_lock()
        os.umask(self._umask)
        log.info("daemon_stopped")

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _completion_path(self, clock: Callable[[], float]) -> tuple[CompletionService, HistoryBudget]:
        """The completion service and its collaborators (admission, the preparation of a turn, its
        run), and the history budget the conversation service bounds pins with."""
        settings = self.settings
        # by model prefix; every other model is litellm's (the built-in echo among them)
        answerers = Answerers(self.provider, {"consortium/": self.consortium, **cli_providers(self.provider)})
        requests = RequestRegistry(settings.finished_requests_kept)
        # one limits object with the consortium: its member calls count against the same limits;
        # a job answered by an answerer (a consortium run) takes no slot itself, its calls do
        scheduler = Scheduler(self.limits, takes_slot=answerers.takes_slot, leases=self.storage.leases,
                              offers=self.storage.requests)
        calibration = Calibration(self.storage.calibration, enabled=settings.calibration)
        budget = HistoryBudget(settings, self.litellm, calibration)
        compactor = Compactor(settings, self.router, self.cache, self.writer, self.provider,
                              self.litellm.count_tokens, budget.history, answerers.for_model)
        attachments = Attachments(settings.allowed_file_roots, self.litellm.count_tokens)
        images = Images(self.storage.blobs, FileRoots(settings.allowed_file_roots), settings.max_image_bytes)
        preparation = TurnPreparation(settings, self.cache, self.litellm, answerers, budget, compactor, attachments,
                                      images, clock=clock)
        # wait, status and cancel for requests other daemons of the pool accepted
        elsewhere = RequestsElsewhere(self.storage.requests, self.store, self.responses, self.storage.daemon_id)
        runner = TurnRunner(settings, preparation, self.writer, self.responses, answerers, requests, elsewhere,
                            self.breaker, self.litellm.count_tokens, clock=clock)
        admission = Admission(settings, self.router, self.cache, self.writer, self.responses, answerers,
                              images, attachments, scheduler, requests, agents=self.agent_registry, clock=clock)
        completion = CompletionService(settings, self.router, self.cache, self.writer, self.responses,
                                       self.storage.journal, requests, scheduler, admission, runner, compactor,
                                       elsewhere, clock=clock)
        return completion, budget

    def _http_front(self) -> HttpFront | NoHttpFront:
        """The HTTP front with every HTTP door's routes, or a do-nothing one when no address is set."""
        if not self.settings.http_addr:
            return NoHttpFront()
        # imported here: starlette and uvicorn load only when HTTP is served
        from ksi_daemon.transports.console import console_routes
        from ksi_daemon.transports.http.anthropic.routes import messages_routes
        from ksi_daemon.transports.http.auth import BrowserSessions
        from ksi_daemon.transports.http.front import HttpFront
        from ksi_daemon.transports.http.login_codes import LoginCodes
        from ksi_daemon.transports.http.mcp import mcp_routes
        from ksi_daemon.transports.http.openai import openai_routes

        # the console's links live under their cookie's path; spent login codes outlive a restart
        sessions = BrowserSessions(LoginCodes(self.layout.state_dir / "console_codes.json"))
        groups = [
            messages_routes(self._handle_request, self.settings),  # first: its /v1/models answers both shapes
            openai_routes(self._handle_request, self.settings),
            mcp_routes(self._handle_request, self.settings),
            console_routes(self._handle_request, self.settings, sessions.root),  # last: it serves "/"
        ]
        return HttpFront(self.settings, groups, sessions, self.connection_budget)

    def _announce_waiting(self, conversation_id: str, key: str) -> None:
        self.storage.relay.publish(WAITING_RELAYED, {"conversation_id": conversation_id, "key": key}, {})

    def _deliver_remote(self, event: str, data: dict[str, Any], context: dict[str, Any]) -> None:
        """Another daemon's event: a conversation it says waits goes to this daemon's candidates
        (a request on this daemon may take its pending input); the rest to the subscribers."""
        if event == WAITING_RELAYED:
            self.cache.waiting.heard(str(data.get("conversation_id")), str(data.get("key")))
            return
        self.monitor.deliver_remote(event, data, context)

    def _relay_outcome(self, name: str, data: dict[str, Any], context: EventContext) -> None:
        if name in RELAYED:
            self.storage.relay.publish(name, data, context.to_wire())

    async def _handle_request(self, event: str, data: Any, context: EventContext) -> dict[str, Any]:
        if self.shutting_down and event != SYSTEM_HEALTH:
            raise KsiError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        try:
            return await self.router.request(event, data, context)
        except OSError as exc:
            # out of descriptors (its limit lowered while it runs, or too much open): any file the
            # request needed failed to open; the daemon serves again once descriptors free up
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            log.warning("out_of_descriptors", event_name=event, error=exc.strerror or str(exc))
            raise KsiError(ErrorCode.TOO_MANY_CONNECTIONS, "the daemon has no file descriptor left for this "
                           "request (too many open files); retry later", retry_after=1.0) from None

    # -- var dir ------------------------------------------------------------
    def _prepare_dirs(self) -> None:
        run_dir = self.layout.run_dir
        for path in (run_dir, self.layout.lock_file, self.layout.state_dir, self.layout.logs_dir):
            # the lock is opened with O_TRUNC, var/run chmodded: through a link both hit its target
            if path.is_symlink():
                raise UnsafeVarDir(f"{path} is a symbolic link; the daemon never writes through one "
                                   "(refusing to start: replace it with the directory or file itself)")
        if run_dir.exists():
            mode = run_dir.stat().st_mode
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise UnsafeVarDir(f"{run_dir} is writable by other users; refusing to start (chmod 700 it)")
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for directory in (self.layout.state_dir, self.layout.daemon_log.parent):
            private_dir(directory)

    def _acquire_lock(self) -> None:
        lock = filelock.FileLock(str(self.layout.lock_file), mode=FILE_MODE)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            pid = self.layout.pid_file.read_text().strip() if self.layout.pid_file.exists() else "?"
            raise DaemonAlreadyRunning(
                f"another daemon (pid {pid}) is already running on {self.layout.root}"
            ) from None
        self._lock = lock

    def _clear_stale_files(self) -> None:
        """The lock is ours, so a pid file here belongs to a dead daemon. The socket path may lie
        outside the var dir (a shared directory): only a socket nobody answers on is removed."""
        pid_file = self.layout.pid_file
        if pid_file.exists() or pid_file.is_symlink():
            log.warning("stale_file_removed", path=str(pid_file))
            pid_file.unlink()
        sock = self.settings.socket
        state = socket_path_state(sock)
        if state == "foreign":
            raise UnsafeSocketPath(f"{sock} exists and is not a socket; refusing to replace it")
        if state == "live":
            raise DaemonAlreadyRunning(f"another daemon already answers on {sock}")
        if state == "stale":
            log.warning("stale_file_removed", path=str(sock))
            sock.unlink()


async def run_daemon(settings: Settings) -> Daemon:
    daemon = Daemon(settings)
    await daemon.start()
    await daemon.serve_forever()
    return daemon
