"""The review page: a Starlette application served by uvicorn, for one release and one study.

Safe by default, as notebook servers are: it binds 127.0.0.1, and every request must carry the random access token
that the printed URL holds (compared in constant time). Opening that URL sets the token as an HttpOnly, SameSite=Strict
cookie and redirects to the bare page, so the token leaves the address bar; the token is printed once, to the
terminal, and never logged (uvicorn's access log is off). The page, its script and its style are fixed bytes read at
start; images and metadata are found by item number in the study's list, never by a path from the request. Host
headers other than the bound address are refused (DNS rebinding), and the page's Content-Security-Policy allows only
its own script, style and images.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import socket
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.review.index import ReleaseIndex, marked_words
from builder.review.store import MAX_REASON, VERDICTS, JudgementStore, check_reviewer
from builder.review.study import REJECT_REASONS, Study, reviewer_order, select
from lance_pipeline.readers import load_json

logger = logging.getLogger(__name__)

COOKIE = "lance_cf_review"
# A judgement is a few hundred bytes (a reason is at most MAX_REASON characters): a larger body is refused unread.
MAX_BODY_BYTES = 16 * 1024
ITEM_PATTERN = re.compile(r"[0-9]{1,9}")
STATIC = {"review.js": "text/javascript", "review.css": "text/css"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# Metadata shown in blind mode: what the question needs (the class, the captions, and the fields the release's kind
# declares: ReleaseKind.review_fields, e.g. the shift or prompt), nothing an automatic filter decided.
SCORE_DIGITS = 4


class ReviewSession:
    """One release, one study: the items, their views and the judgements."""

    def __init__(self, index: ReleaseIndex, store: JudgementStore, study: Study, reviewer: str | None = None):
        self.index, self.store, self.study, self.default_reviewer = index, store, study, reviewer
        self.items = select(study, index)
        if not self.items:
            raise ValueError(f"study {study.name!r} selects no sample of {index.root}")
        self.questions = {q.id: q for q in study.questions}
        self.kind = rf.release_kind(index.manifest)

    def check_state(self) -> None:
        """Read every stored judgement of the study once, so a database changed outside the page is refused (one
        line naming the row) before the page is served, not on a reviewer's first request."""
        self.store.latest(self.study)

    # -- reading ----------------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        m = self.index.manifest
        return {
            "release": {"name": m.name, "version": m.version, "kind": self.index.kind},
            "study": {
                "name": self.study.name,
                "questions": [{"id": q.id, "text": q.text, "answers": list(q.answers)} for q in self.study.questions],
                "blind": self.study.blind,
                "show_original": self.study.show_original,
                "items": len(self.items),
            },
            "reasons": list(REJECT_REASONS),
            "verdicts": list(VERDICTS),
            "reviewer": self.default_reviewer,
        }

    def queue(self, reviewer: str) -> dict[str, Any]:
        """The reviewer's order of items and their latest judgements."""
        latest = self.store.latest(self.study, reviewer)
        position = {item: i for i, item in enumerate(self.items)}
        judged: dict[int, dict[str, Any]] = {}
        for (_, config, key, question), judgement in latest.items():
            i = position.get((config, key))
            if i is None:
                continue
            entry = judged.setdefault(i, {"answers": {}})
            if question == "verdict":
                entry.update(verdict=judgement.answer, reason=judgement.reason)
            else:
                entry["answers"][question] = judgement.answer
        judged = {i: e for i, e in judged.items() if "verdict" in e}
        return {
            "order": reviewer_order(self.study, len(self.items), reviewer),
            "judged": {str(i): e for i, e in judged.items()},
            "left": len(self.items) - len(judged),
        }

    def view(self, item: int) -> dict[str, Any]:
        config, key = self.items[item]
        sample = self.index.get(config, key)
        meta = sample.meta
        original = self.index.original_of(sample) if self.study.show_original else None
        # what the sample changes: the first of its kind's edit fields it has (the edited span, the shift, the failure)
        edit = next((meta[f] for f in self.kind.review_edit_fields if meta.get(f)), None)
        view: dict[str, Any] = {
            "item": item,
            "label": meta.get("label_name"),
            "edit_type": meta.get("edit_type"),
            "caption": marked_words(meta.get("caption"), meta.get("edited_caption")),
            "edited_caption": marked_words(meta.get("edited_caption"), meta.get("caption")),
            "edit": edit,
            "image": f"image/{item}",
            "original": f"image/{item}/original" if original is not None else None,
            "questions": [
                {
                    "id": q.id,
                    "text": q.text.replace("{class}", str(meta.get("label_name"))).replace("{edit}", str(edit or "")),
                    "answers": list(q.answers),
                }
                for q in self.study.questions
            ],
        }
        fields = {f: meta.get(f) for f in self.index.extra_fields(config)}
        if self.study.blind:
            view["fields"] = {f: v for f, v in fields.items() if f in self.kind.review_fields and v is not None}
            return view
        view["config"], view["key"] = config, key
        view["scores"] = {
            k: round(v, SCORE_DIGITS) for k, v in (meta.get("scores") or {}).items() if isinstance(v, int | float)
        }
        view["fields"] = {f: v for f, v in fields.items() if v is not None}
        view["sensitive"] = meta.get("sensitive_attributes") if meta.get("sensitive_edit") else None
        return view

    def image(self, item: int, original: bool) -> bytes | None:
        sample = self.index.get(*self.items[item])
        if original:
            if not self.study.show_original:
                return None
            sample = self.index.original_of(sample)
            if sample is None:
                return None
        return self.index.image(sample)

    # -- writing ----------------------------------------------------------------------------------------------------
    def judge(self, body: Any) -> dict[str, Any]:
        """Validate and store one judgement; ``ValueError`` names what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        reviewer = self.check_reviewer(body.get("reviewer"))
        item = body.get("item")
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < len(self.items):
            raise ValueError(f"item must be an item number of this study (0 to {len(self.items) - 1})")
        verdict = body.get("verdict")
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}")
        reason = body.get("reason")
        if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON):
            raise ValueError(f"reason must be text of at most {MAX_REASON} characters")
        reason = (reason or "").strip() or None
        if verdict == "reject" and reason is None:
            raise ValueError("a rejection needs a reason")
        answers = body.get("answers") or {}
        # a flag (a second look is needed) keeps the answers given so far, even none; other verdicts answer all
        complete = isinstance(answers, dict) and set(answers) == set(self.questions)
        if not complete and not (
            verdict == "flag" and isinstance(answers, dict) and set(answers) <= set(self.questions)
        ):
            raise ValueError(f"answer every question of the study: {', '.join(self.questions) or 'none'}")
        for qid, answer in answers.items():
            if answer not in self.questions[qid].answers:
                raise ValueError(f"question {qid}: answer one of {', '.join(self.questions[qid].answers)}")
        config, key = self.items[item]
        self.store.record(self.study.name, reviewer, config, key, {**answers, "verdict": verdict}, reason)
        logger.info("judged item %d (%s) as %s", item, reviewer, verdict)
        return {"saved": True, "left": self.queue(reviewer)["left"]}

    def check_reviewer(self, name: Any) -> str:
        """A well-formed name, and one of the study's reviewers when the study names them."""
        name = check_reviewer(name)
        if self.study.reviewers and name not in self.study.reviewers:
            raise NotAReviewer(f"reviewer {name!r} is not one of study {self.study.name!r}'s reviewers")
        return name


class NotAReviewer(ValueError):
    """A name the study's list of reviewers does not hold (HTTP 403)."""


def _static_files() -> dict[str, bytes]:
    root = resources.files("builder.review") / "static"
    return {name: (root / name).read_bytes() for name in ("review.html", *STATIC)}


def create_app(session: ReviewSession, token: str, allowed_hosts: list[str]):
    """The Starlette application of ``session``, every request gated by ``token``."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route

    files = _static_files()
    secret = token.encode()
    headers = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}

    def authorised(request: Request) -> bool:
        for supplied in (request.cookies.get(COOKIE), request.headers.get("x-review-token")):
            if supplied and hmac.compare_digest(supplied.encode(), secret):
                return True
        return False

    async def page(request: Request) -> Response:
        supplied = request.query_params.get("token")
        if supplied is not None:
            if not hmac.compare_digest(supplied.encode(), secret):
                return _forbidden()
            response = RedirectResponse("/", status_code=303, headers=headers)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
            return response
        if not authorised(request):
            return _forbidden()
        return Response(
            files["review.html"], media_type="text/html", headers={**headers, "Content-Security-Policy": CSP}
        )

    def gated(handler):
        async def endpoint(request: Request) -> Response:
            if not authorised(request):
                return _forbidden()
            try:
                return await handler(request)
            except _TooLarge as err:
                return JSONResponse({"error": str(err)}, status_code=413, headers=headers)
            except NotAReviewer as err:
                return JSONResponse({"error": str(err)}, status_code=403, headers=headers)
            except ValueError as err:  # a malformed request, or a store that cannot be read: named, no traceback
                return JSONResponse({"error": " ".join(str(err).split())[:500]}, status_code=400, headers=headers)
            except Exception as err:  # noqa: BLE001 - a bug must not print a traceback on the reviewer's terminal
                logger.error("review page: %s %s failed (%s)", request.method, request.url.path, type(err).__name__)
                return JSONResponse({"error": "internal error"}, status_code=500, headers=headers)

        return endpoint

    def _forbidden() -> Response:
        return PlainTextResponse(
            "forbidden: open the URL that lance-cf review printed (it carries the access token)\n", status_code=403
        )

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("not found\n", status_code=404)
        return Response(files[name], media_type=STATIC[name], headers=headers)

    async def describe(request: Request) -> Response:
        return JSONResponse(session.describe(), headers=headers)

    async def queue(request: Request) -> Response:
        return JSONResponse(
            session.queue(session.check_reviewer(request.query_params.get("reviewer"))), headers=headers
        )

    def _item(request: Request) -> int | None:
        """The item number of the path, or None (not found) for anything but a number of this study's items."""
        text = request.path_params["item"]
        if not ITEM_PATTERN.fullmatch(text):
            return None
        item = int(text)
        return item if 0 <= item < len(session.items) else None

    async def item_view(request: Request) -> Response:
        item = _item(request)
        if item is None:
            return PlainTextResponse("not found\n", status_code=404)
        return JSONResponse(session.view(item), headers=headers)

    def image_endpoint(original: bool):
        async def image(request: Request) -> Response:
            item = _item(request)
            data = None if item is None else session.image(item, original)
            if data is None:
                return PlainTextResponse("not found\n", status_code=404)
            return Response(data, media_type=session.index.image_type, headers=headers)

        return image

    async def judge(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise ValueError("send the judgement as application/json")
        declared = request.headers.get("content-length", "")
        if declared and (not declared.isdigit() or len(declared) > 12 or int(declared) > MAX_BODY_BYTES):
            raise _TooLarge(f"a judgement is at most {MAX_BODY_BYTES:,} bytes")
        body = bytearray()
        async for chunk in request.stream():  # a body without a length is counted as it arrives, never held whole
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise _TooLarge(f"a judgement is at most {MAX_BODY_BYTES:,} bytes")
        return JSONResponse(session.judge(load_json(bytes(body), "the judgement")), headers=headers)

    routes = [
        Route("/", page),
        Route("/static/{name}", gated(static)),
        Route("/api/session", gated(describe)),
        Route("/api/queue", gated(queue)),
        Route("/api/item/{item}", gated(item_view)),
        Route("/image/{item}", gated(image_endpoint(False))),
        Route("/image/{item}/original", gated(image_endpoint(True))),
        Route("/api/judgement", gated(judge), methods=["POST"]),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)])

    async def not_found(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("not found\n", status_code=404)

    app.add_exception_handler(404, not_found)
    return app


class _TooLarge(ValueError):
    """A request body over ``MAX_BODY_BYTES`` (HTTP 413)."""


def serve(session: ReviewSession, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
    """Serve the page until interrupted; print its URL (with the token) once, to stdout."""
    import uvicorn

    token = token or secrets.token_urlsafe(32)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port") from err
    sock.listen(128)  # connections wait in the backlog from now on: the printed URL works at once
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    allowed = sorted({host, "127.0.0.1", "localhost", "[::1]"} if host in ("127.0.0.1", "localhost", "::1") else {host})
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: anyone who can reach it and has the token can read and judge", host)
        allowed = ["*"] if host in ("0.0.0.0", "::") else allowed
    app = create_app(session, token, allowed)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    m = session.index.manifest
    sys.stdout.write(
        f"lance-cf review: {m.name} {m.version}, study {session.study.name!r}: {len(session.items)} sample(s)\n"
        f"  open http://{shown}:{bound}/?token={token}\n"
        "  keys: 1-9 answer, a accept, r reject, f flag, Backspace back, s skip, ? help; Ctrl-C stops the server "
        "(judgements are saved as they are made)\n"
    )
    sys.stdout.flush()
    server.run(sockets=[sock])


def open_session(
    release: Path, study: Study | None, study_name: str | None, reviewer: str | None
) -> tuple[ReviewSession, JudgementStore]:
    """The index, the judgement store and the study of ``release`` (a stored study continues by name)."""
    index = ReleaseIndex(release)
    store = JudgementStore(release, index.manifest_sha)
    if study is None:
        name = study_name or "review"
        stored = store.study_spec(name)
        study = Study.from_dict(stored, where=f"study {name!r}") if stored else Study(name=name)
    store.save_study(study.name, study.to_dict())
    session = ReviewSession(index, store, study)
    if reviewer is not None:
        session.default_reviewer = session.check_reviewer(reviewer)
    session.check_state()
    return session, store
