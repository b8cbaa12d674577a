// attnkit's one error type: every invalid argument raises attnkit::Error, whose message
// names the argument, what was expected and what was got. Python sees it as ValueError.
#pragma once

#include <stdexcept>
#include <string>

namespace attnkit {

class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace attnkit
