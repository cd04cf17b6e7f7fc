"""``/admin`` in a browser: the dashboard, and signing in with the admin key or a login link."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.dashboard.auth import (
    COOKIE,
    COOKIE_PATH,
    LOGIN_LINK_S,
    SESSION_S,
    has_admin_session,
    sign,
    verify,
)
from api.dashboard.data import gather_replicas, gather_usage
from api.dashboard.page import dashboard_page, login_page
from api.deps import AdminAccess, Context, is_admin_key

router = APIRouter(prefix="/admin", tags=["dashboard"])


SIGN_IN_PAGE = {"description": "The sign-in page, saying what was wrong", "content": {"text/html": {}}}
TO_DASHBOARD = {"description": "Signed in: on to /admin with the session cookie set"}


class LoginLink(BaseModel):
    url: str
    expires_at: int


def _signed_in(ctx: Context, request: Request) -> RedirectResponse:
    response = RedirectResponse("/admin", status_code=303)
    response.set_cookie(
        COOKIE,
        sign(ctx.settings, "session", SESSION_S) or "",
        max_age=SESSION_S,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


def _admin_in_header(ctx: Context, request: Request) -> bool:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and is_admin_key(ctx.settings, key.strip())


@router.get("", response_class=HTMLResponse, summary="Dashboard", responses={401: SIGN_IN_PAGE})
async def dashboard(request: Request, ctx: Context) -> HTMLResponse:
    """Usage over time per tenant, top models, job outcomes, replicas and their pools (HTML). Without the admin
    key or a session, the sign-in page (401)."""
    if not (_admin_in_header(ctx, request) or has_admin_session(ctx, request)):
        return HTMLResponse(login_page(), status_code=401)

    def read_usage():  # type: ignore[no-untyped-def]
        with ctx.reading() as session:
            return gather_usage(session, ctx.bases.label)

    data = await run_in_threadpool(read_usage)
    await gather_replicas(ctx, data)
    return HTMLResponse(dashboard_page(data, ctx.bases.label), headers={"Cache-Control": "no-store"})


@router.post(
    "/login",
    response_class=Response,
    status_code=303,
    responses={303: TO_DASHBOARD, 401: SIGN_IN_PAGE},
    summary="Sign in",
)
def login(request: Request, ctx: Context, key: Annotated[str, Form(max_length=512)]) -> Response:
    """Check the admin key from the sign-in form and set an HttpOnly session cookie."""
    if not is_admin_key(ctx.settings, key):
        return HTMLResponse(login_page("That is not the admin key."), status_code=401)
    return _signed_in(ctx, request)


@router.get(
    "/login",
    response_class=Response,
    status_code=303,
    responses={303: TO_DASHBOARD, 401: SIGN_IN_PAGE},
    summary="Sign in with a login link",
)
def login_with_link(request: Request, ctx: Context, token: str = "") -> Response:
    """Follow a link made by ``POST /admin/login-links``: sets the session cookie and opens the dashboard."""
    if not verify(ctx.settings, "login", token):
        return HTMLResponse(login_page("This login link is invalid or has expired."), status_code=401)
    return _signed_in(ctx, request)


@router.post("/login-links", response_model=LoginLink, summary="Make a login link", dependencies=[AdminAccess])
def make_login_link(ctx: Context) -> LoginLink:
    """A link that signs a browser in without typing the key, valid for 15 minutes (for `loraplex up`, scripts)."""
    token = sign(ctx.settings, "login", LOGIN_LINK_S) or ""
    return LoginLink(url=f"/admin/login?token={token}", expires_at=int(token.split(".", 1)[0]))


@router.post(
    "/logout",
    response_class=Response,
    status_code=303,
    responses={303: {"description": "Signed out: back to the sign-in page"}},
    summary="Sign out of the dashboard",
)
def logout() -> Response:
    """Clear the session cookie."""
    response = RedirectResponse("/admin", status_code=303)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response
