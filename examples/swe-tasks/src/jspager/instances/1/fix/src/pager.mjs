function assertPositiveInteger(value, name) {
  if (!Number.isInteger(value) || value < 1) {
    throw new RangeError(`${name} must be a positive integer, got ${value}`);
  }
}

/** The number of pages needed for `total` items, `perPage` to a page. */
export function pageCount(total, perPage) {
  assertPositiveInteger(perPage, 'perPage');
  if (!Number.isInteger(total) || total < 0) {
    throw new RangeError(`total must be a non-negative integer, got ${total}`);
  }
  return Math.ceil(total / perPage);
}

/** Page `page` (1-based) of `items`; past the last page, an empty one. */
export function paginate(items, page, perPage = 10) {
  assertPositiveInteger(perPage, 'perPage');
  const start = (page - 1) * perPage;
  return {
    items: items.slice(start, start + perPage),
    page,
    perPage,
    total: items.length,
    pages: pageCount(items.length, perPage),
  };
}
