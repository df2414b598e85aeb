// The Config of a binding's `env` argument (torch_reccl._C): RECCL_* settings
// from a dict, or from os.environ when it is None. One reader for every module
// of the bindings, so each takes `env` the same way.
#pragma once

#include <pybind11/pybind11.h>

#include <map>
#include <string>

#include "core/config.h"

namespace reccl {

inline Config configFromEnv(const pybind11::object& env) {
  pybind11::dict source =
      env.is_none() ? pybind11::dict(pybind11::module_::import("os").attr("environ").attr("copy")())
                    : env.cast<pybind11::dict>();
  std::map<std::string, std::string> settings;
  for (auto item : source) settings[pybind11::str(item.first)] = pybind11::str(item.second);
  return Config::fromEnv(settings);
}

}  // namespace reccl
