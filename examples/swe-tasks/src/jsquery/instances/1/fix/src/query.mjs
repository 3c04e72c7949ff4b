// Form encoding writes a space as `+`; decodeURIComponent alone leaves it.
function decode(text) {
  return decodeURIComponent(text.replaceAll('+', ' '));
}

/** Parses a query string (a leading `?` is allowed) into an object. */
export function parse(query) {
  const result = {};
  const text = query.startsWith('?') ? query.slice(1) : query;
  for (const part of text.split('&')) {
    if (part === '') continue;
    const eq = part.indexOf('=');
    const key = decode(eq < 0 ? part : part.slice(0, eq));
    const value = eq < 0 ? '' : decode(part.slice(eq + 1));
    if (Object.hasOwn(result, key)) {
      result[key] = [].concat(result[key], value);
    } else {
      result[key] = value;
    }
  }
  return result;
}

/** Builds a query string (without `?`); arrays repeat their key. */
export function stringify(params) {
  const parts = [];
  for (const [key, value] of Object.entries(params)) {
    for (const v of Array.isArray(value) ? value : [value]) {
      parts.push(`${encodeURIComponent(key)}=${encodeURIComponent(String(v))}`);
    }
  }
  return parts.join('&');
}
