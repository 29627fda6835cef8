"""The failed pages a completion names (a backup's, a store's, a load-back's), checked before
anything changes."""

from __future__ import annotations

from hicache.core.errors import CoreError


def failed_pages(failed: object, total: int, what: str) -> list[int]:
    """The failed pages of an operation over `total` pages, checked: `CoreError` naming `what`
    unless `failed` is a tuple or list of page indices in [0, total). Typed `object`: a
    completion comes from a driver, and the compiled build must refuse a string, a float or a
    bool exactly as plain Python does, before anything changes."""
    if not isinstance(failed, tuple | list):
        raise CoreError(f"{what}: failed pages must be a tuple of page indices, got {failed!r}")
    pages: list[int] = []
    for x in failed:
        page: object = x
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < total:
            raise CoreError(f"{what}: failed pages {list(failed)!r} outside [0, {total}) or not integers")
        pages.append(page)
    return pages


def first_failed(failed: object, total: int, what: str) -> int:
    """The first failed page (checked as `failed_pages` does), or `total` when none failed."""
    pages = failed_pages(failed, total, what)
    return min(pages) if pages else total
