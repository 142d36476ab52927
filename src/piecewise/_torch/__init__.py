"""piecewise's use of torch internals: each private torch name or patch of torch in one module
per torch subsystem, with the torch versions it was verified on, so a torch upgrade touches this
package. The lowest layer: it imports nothing from piecewise."""
