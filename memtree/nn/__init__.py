"""``torch.nn`` integration: modules to trees and back, loading into modules, offloading."""
