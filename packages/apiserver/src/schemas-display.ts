import { z } from 'zod';
import { MAX_DISPLAY_INPUT, POINTER_BUTTONS } from '@dsec/core';
import type { PointerButton } from '@dsec/core';

/** Request bodies of the display routes (`routes/display.ts`); the edge checks them again. */
const Pixel = z.number().int().min(0).max(65_535);
const Delta = z.number().int().min(-65_535).max(65_535);
const Down = z
  .boolean()
  .optional()
  .describe('true: press, false: release; absent: press and release.');

export const DisplayInputEventSchema = z.discriminatedUnion('type', [
  z
    .object({
      type: z.literal('key'),
      key: z
        .string()
        .regex(/^[a-z0-9_]{1,24}$/)
        .describe("QEMU's QKeyCode: `a`, `ret`, `shift`, `ctrl`, `f1`, `esc`…"),
      down: Down,
    })
    .strict(),
  z
    .object({
      type: z.literal('button'),
      button: z.enum(POINTER_BUTTONS as [PointerButton, ...PointerButton[]]),
      down: Down,
    })
    .strict(),
  z
    .object({ type: z.literal('move'), x: Pixel, y: Pixel })
    .strict()
    .describe('Pointer to a pixel of the screen (as the screenshot shows it).'),
  z
    .object({ type: z.literal('moveBy'), dx: Delta, dy: Delta })
    .strict()
    .describe('Pointer moved relatively, in pixels.'),
]);

export const DisplayInputBody = z.union([
  z.object({ events: z.array(DisplayInputEventSchema).max(MAX_DISPLAY_INPUT) }).strict(),
  z
    .object({
      text: z
        .string()
        .max(MAX_DISPLAY_INPUT)
        .describe('Typed key by key on a US layout (printable ASCII, tab, newline).'),
    })
    .strict(),
]);
